//! Which compute device a worker runs its model on (`--device cpu|cuda:N`), and the
//! backend built for it.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::backend::{CpuBackend, ModelBackend};
use crate::error::{EngineError, Result};
use crate::kv_sizing::KvPool;
use crate::model::LlamaModel;

/// A compute device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// The candle CPU backend (the default).
    #[default]
    Cpu,
    /// CUDA device number `n`.
    Cuda(usize),
}

impl FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device {s:?}: expected cpu or cuda:N")),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// The backend for `device`, with a KV pool of blocks of `block_size` tokens sized by
/// `pool` (sizing from device memory is CUDA's; the CPU backend needs a block count).
/// CUDA checks that its libraries and the device are there before touching them, and
/// fails with an [`EngineError::Device`] naming what is missing.
pub fn new_backend(
    device: Device,
    model: Arc<LlamaModel>,
    pool: KvPool,
    block_size: usize,
) -> Result<Box<dyn ModelBackend>> {
    match device {
        Device::Cpu => match pool {
            KvPool::Blocks(n) => Ok(Box::new(CpuBackend::new(model, n, block_size))),
            KvPool::MemoryFraction { .. } => Err(EngineError::Config(
                "the CPU backend's KV pool needs a block count (--num-blocks); sizing from \
                 device memory is for cuda:N"
                    .into(),
            )),
        },
        #[cfg(feature = "cuda")]
        Device::Cuda(n) => Ok(Box::new(crate::cuda::CudaBackend::new(
            model, pool, block_size, n,
        )?)),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(EngineError::Device(
            "this build of kvfleet-engine has no CUDA support (feature `cuda` is off)".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_devices() {
        assert_eq!("cpu".parse::<Device>(), Ok(Device::Cpu));
        assert_eq!("cuda:0".parse::<Device>(), Ok(Device::Cuda(0)));
        assert_eq!("cuda:3".parse::<Device>(), Ok(Device::Cuda(3)));
        assert_eq!("cuda".parse::<Device>(), Ok(Device::Cuda(0)));
        assert!("gpu".parse::<Device>().is_err());
        assert!("cuda:x".parse::<Device>().is_err());
        assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
        assert_eq!(Device::Cpu.to_string(), "cpu");
    }

    #[test]
    fn cpu_pool_takes_a_block_count_only() {
        let model = Arc::new(LlamaModel::seeded(crate::ModelConfig::tiny(), 1).unwrap());
        let b = new_backend(Device::Cpu, Arc::clone(&model), KvPool::Blocks(8), 16).unwrap();
        assert_eq!(b.num_blocks(), 8);
        assert!(b.kv_sizing().is_none());
        let fraction = KvPool::MemoryFraction {
            utilization: 0.9,
            max_step_tokens: 2048,
        };
        let e = new_backend(Device::Cpu, model, fraction, 16).err().unwrap();
        assert!(e.to_string().contains("--num-blocks"), "{e}");
    }
}
