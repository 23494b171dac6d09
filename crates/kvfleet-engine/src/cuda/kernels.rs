//! The CUDA kernels: their sources (embedded from the top-level `kernels/*.cu`), their
//! entry points, and their compilation with NVRTC for the device's architecture.
//!
//! All files are compiled as one program, `common.cuh` first: the kernels include no
//! toolkit header, so NVRTC's library alone compiles them (no CUDA install needed to
//! check them, see `tests/cuda_kernels_compile.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use super::probe::nvrtc_present;
use crate::error::{EngineError, Result};

/// Kernel sources by file name, in compilation order.
pub const SOURCES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../../../../kernels/common.cuh")),
    (
        "embedding.cu",
        include_str!("../../../../kernels/embedding.cu"),
    ),
    (
        "rms_norm.cu",
        include_str!("../../../../kernels/rms_norm.cu"),
    ),
    ("rope.cu", include_str!("../../../../kernels/rope.cu")),
    (
        "silu_mul.cu",
        include_str!("../../../../kernels/silu_mul.cu"),
    ),
    (
        "reshape_and_cache.cu",
        include_str!("../../../../kernels/reshape_and_cache.cu"),
    ),
    (
        "copy_blocks.cu",
        include_str!("../../../../kernels/copy_blocks.cu"),
    ),
    (
        "paged_decode.cu",
        include_str!("../../../../kernels/paged_decode.cu"),
    ),
    (
        "prefill_attention.cu",
        include_str!("../../../../kernels/prefill_attention.cu"),
    ),
];

/// Head widths the attention kernels are instantiated for.
pub const HEAD_DIMS: &[usize] = &[16, 32, 64, 128];

/// Query heads per KV head the decode kernel is instantiated for (a group of another
/// size runs in the next larger instance).
pub const DECODE_GROUPS: &[usize] = &[1, 2, 4, 8];

/// The name of the decode kernel for `head_dim` and the smallest instantiated group
/// holding `group` query heads; `None` when there is none.
pub fn decode_kernel_name(head_dim: usize, group: usize) -> Option<String> {
    let g = DECODE_GROUPS.iter().find(|&&g| g >= group)?;
    HEAD_DIMS
        .contains(&head_dim)
        .then(|| format!("paged_decode_hd{head_dim}_g{g}"))
}

/// The name of the prefill attention kernel for `head_dim`.
pub fn prefill_kernel_name(head_dim: usize) -> Option<String> {
    HEAD_DIMS
        .contains(&head_dim)
        .then(|| format!("prefill_attention_hd{head_dim}"))
}

/// Every `extern "C"` entry point the program must define.
pub fn entry_points() -> Vec<String> {
    let mut names: Vec<String> = [
        "embed_tokens",
        "add_bias",
        "rms_norm",
        "qk_norm_rope",
        "silu_mul",
        "reshape_and_cache",
        "copy_blocks",
        "paged_decode_reduce",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for &hd in HEAD_DIMS {
        for &g in DECODE_GROUPS {
            names.push(format!("paged_decode_hd{hd}_g{g}"));
        }
        names.push(format!("prefill_attention_hd{hd}"));
    }
    names
}

/// The whole program: every source, `common.cuh` first.
pub fn program_source() -> String {
    let mut src = String::new();
    for (name, text) in SOURCES {
        src.push_str(&format!("// ---- {name} ----\n"));
        src.push_str(text);
        src.push('\n');
    }
    src
}

/// Compiles the program to PTX for `compute_{major}{minor}` (e.g. `(9, 0)` for Hopper).
pub fn compile_ptx(compute_capability: (i32, i32)) -> Result<String> {
    compile_source(&program_source(), compute_capability)
}

/// Compiles `source` to PTX for `compute_{major}{minor}`; NVRTC's log is in the error.
pub fn compile_source(source: &str, compute_capability: (i32, i32)) -> Result<String> {
    if !nvrtc_present() {
        return Err(EngineError::Device(
            "NVRTC (libnvrtc.so.13) cannot be loaded: install the CUDA 13 toolkit or \
             `pip install nvidia-cuda-nvrtc==13.0.88` and put its lib folder \
             (site-packages/nvidia/cu13/lib) on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let (major, minor) = compute_capability;
    let opts = CompileOptions {
        options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
        name: Some("kvfleet_kernels.cu".into()),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(source, opts)
        .map_err(|e| EngineError::Device(format!("NVRTC failed on the kernels: {e}")))?;
    Ok(ptx.to_src())
}

/// PTX already compiled in this process, by compute capability: NVRTC takes seconds,
/// and every backend of a process (one per in-process worker) needs the same program.
fn cached_ptx(cc: (i32, i32)) -> Result<String> {
    static CACHE: OnceLock<Mutex<HashMap<(i32, i32), String>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = map.get(&cc) {
        return Ok(p.clone());
    }
    let ptx = compile_ptx(cc)?;
    map.insert(cc, ptx.clone());
    Ok(ptx)
}

/// The loaded kernels of one device, by entry point.
pub(crate) struct Kernels {
    fns: HashMap<String, CudaFunction>,
}

impl Kernels {
    /// Compiles the program for the device of `ctx` and loads every entry point.
    pub(crate) fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        let cc = ctx
            .compute_capability()
            .map_err(super::device_err("reading the compute capability"))?;
        let ptx = cached_ptx(cc)?;
        let module = ctx
            .load_module(Ptx::from_src(ptx))
            .map_err(super::device_err("loading the kernels' PTX"))?;
        let mut fns = HashMap::new();
        for name in entry_points() {
            let f = module
                .load_function(&name)
                .map_err(|e| EngineError::Device(format!("kernel {name}: {e:?}")))?;
            fns.insert(name, f);
        }
        Ok(Self { fns })
    }

    /// The kernel `name`.
    pub(crate) fn get(&self, name: &str) -> Result<&CudaFunction> {
        self.fns
            .get(name)
            .ok_or_else(|| EngineError::Device(format!("no kernel named {name}")))
    }
}
