# syntax=docker/dockerfile:1
# The `kvfleet` binary on a slim Debian, running as a non-root user.
#   docker build -t kvfleet:0.1.0 .
# The same image runs every role: `kvfleet router …`, `kvfleet worker …`, `kvfleet up`.

# --- build ---------------------------------------------------------------------------
FROM rust:1-bookworm AS build
# protoc: etcd-client's build script. librdkafka (rdkafka-sys) builds with the image's
# own cc, make and zlib headers.
RUN apt-get update \
 && apt-get install -y --no-install-recommends protobuf-compiler \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin kvfleet \
 && cp target/release/kvfleet /usr/local/bin/kvfleet

# --- run -----------------------------------------------------------------------------
FROM debian:bookworm-slim
# The binary needs libc, libgcc_s, libm and libz (librdkafka) at run time: all in the
# base image.
COPY --from=build /usr/local/bin/kvfleet /usr/local/bin/kvfleet
# The numeric id the chart's securityContext runs as (runAsNonRoot needs a number).
USER 65532:65532
EXPOSE 8080 50051 9090
ENTRYPOINT ["/usr/local/bin/kvfleet"]
CMD ["up", "--http", "0.0.0.0:8080"]
