//! TLS flags of the serving commands and the configurations built from them: HTTPS on
//! the router's HTTP front (`up`, `router`), TLS with optional client-certificate
//! checks on a worker's gRPC server (`worker`), and the router's client side of mutual
//! TLS to its workers (`router`). Certificates and keys are PEM files, read and checked
//! once at start so a bad path or PEM stops the process with the file's name.

use anyhow::{Context, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// HTTPS on the OpenAI-compatible HTTP front.
#[derive(Args, Clone, Debug)]
pub struct HttpTlsArgs {
    /// Serve HTTPS with this certificate chain (PEM; leaf first). Needs --tls-key.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM: PKCS#8, PKCS#1 or SEC1) of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

impl HttpTlsArgs {
    /// The rustls server configuration, or `None` for plain HTTP.
    pub fn server_config(&self) -> Result<Option<Arc<rustls::ServerConfig>>> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
            return Ok(None);
        };
        let chain = read_certs(cert)?;
        let key_der = read_key(key)?;
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .with_context(|| {
            format!(
                "{} and {} are not a usable certificate and key",
                cert.display(),
                key.display()
            )
        })?;
        // HTTP/2 first, as clients that speak it prefer; HTTP/1.1 for the rest.
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Some(Arc::new(config)))
    }

    /// `https` with TLS, `http` without (for the start-up line).
    pub fn scheme(&self) -> &'static str {
        if self.tls_cert.is_some() {
            "https"
        } else {
            "http"
        }
    }
}

/// TLS on a worker's gRPC server.
#[derive(Args, Clone, Debug)]
pub struct WorkerServerTlsArgs {
    /// Serve gRPC over TLS with this certificate chain (PEM). Needs --tls-key.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Require every client (router) to present a certificate signed by this CA (PEM):
    /// mutual TLS. Needs --tls-cert.
    #[arg(long, requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
}

impl WorkerServerTlsArgs {
    /// The gRPC server's TLS settings, or `None` for plaintext.
    pub fn server_config(&self) -> Result<Option<tonic::transport::ServerTlsConfig>> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
            return Ok(None);
        };
        let cert_pem = read_pem(cert, Kind::Certs)?;
        let key_pem = read_pem(key, Kind::Key)?;
        let mut config = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(cert_pem, key_pem))
            .timeout(HANDSHAKE_TIMEOUT);
        if let Some(ca) = &self.tls_client_ca {
            let ca_pem = read_pem(ca, Kind::Certs)?;
            config = config.client_ca_root(tonic::transport::Certificate::from_pem(ca_pem));
        }
        Ok(Some(config))
    }
}

/// The router's side of TLS to its workers.
#[derive(Args, Clone, Debug)]
pub struct WorkerClientTlsArgs {
    /// Connect to workers over TLS, trusting worker certificates signed by this CA
    /// (PEM); worker endpoints then use `https://`.
    #[arg(long)]
    pub worker_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) presented to workers that require one (mutual TLS).
    /// Needs --worker-tls-key and --worker-tls-ca.
    #[arg(long, requires_all = ["worker_tls_key", "worker_tls_ca"])]
    pub worker_tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --worker-tls-cert.
    #[arg(long, requires = "worker_tls_cert")]
    pub worker_tls_key: Option<PathBuf>,
}

impl WorkerClientTlsArgs {
    /// The gRPC client's TLS settings, or `None` for plaintext.
    pub fn client_config(&self) -> Result<Option<tonic::transport::ClientTlsConfig>> {
        let Some(ca) = &self.worker_tls_ca else {
            return Ok(None);
        };
        let ca_pem = read_pem(ca, Kind::Certs)?;
        let mut config = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(ca_pem))
            .timeout(HANDSHAKE_TIMEOUT);
        if let (Some(cert), Some(key)) = (&self.worker_tls_cert, &self.worker_tls_key) {
            let cert_pem = read_pem(cert, Kind::Certs)?;
            let key_pem = read_pem(key, Kind::Key)?;
            config = config.identity(tonic::transport::Identity::from_pem(cert_pem, key_pem));
        }
        Ok(Some(config))
    }
}

/// Longest TLS handshake a server waits for (a client that stalls mid-handshake holds
/// a connection no longer).
pub const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

#[derive(Clone, Copy)]
enum Kind {
    Certs,
    Key,
}

/// Reads a PEM file and checks it holds what `kind` needs, so a wrong file is refused
/// at start with its name rather than at the first handshake.
fn read_pem(path: &Path, kind: Kind) -> Result<Vec<u8>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    match kind {
        Kind::Certs => {
            certs_from(&bytes, path)?;
        }
        Kind::Key => {
            PrivateKeyDer::from_pem_slice(&bytes)
                .with_context(|| format!("{}: no PEM private key", path.display()))?;
        }
    }
    Ok(bytes)
}

fn certs_from(bytes: &[u8], path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{}: bad PEM", path.display()))?;
    anyhow::ensure!(
        !certs.is_empty(),
        "{}: no PEM certificate in the file",
        path.display()
    );
    Ok(certs)
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    certs_from(&bytes, path)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    PrivateKeyDer::from_pem_slice(&bytes)
        .with_context(|| format!("{}: no PEM private key", path.display()))
}
