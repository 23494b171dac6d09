//! Compiles every CUDA kernel with NVRTC for sm_90 (Hopper) and checks that each entry
//! point the backend loads is in the PTX. Needs only NVRTC's library, no GPU:
//! `scripts/test.sh` installs it (`pip install nvidia-cuda-nvrtc==13.0.88`) and puts its
//! folder on `LD_LIBRARY_PATH`. Without it the tests fail and say so.

#![cfg(feature = "cuda")]

use kvfleet_engine::cuda::kernels;
use kvfleet_engine::cuda::probe::nvrtc_present;

const HOW: &str = "NVRTC (libnvrtc.so.13) cannot be loaded: run `bash scripts/test.sh`, or \
    `pip install nvidia-cuda-nvrtc==13.0.88` and add \
    $(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], \"cu13\", \"lib\"))') \
    to LD_LIBRARY_PATH";

#[test]
fn every_kernel_compiles_for_sm90_with_each_entry_point() {
    assert!(nvrtc_present(), "{HOW}");
    let ptx = kernels::compile_ptx((9, 0)).unwrap_or_else(|e| panic!("{e}"));
    assert!(ptx.contains(".target sm_90"), "PTX not for sm_90");
    let names = kernels::entry_points();
    for name in &names {
        assert!(
            ptx.contains(&format!(".entry {name}(")),
            "entry point {name} missing from the PTX"
        );
    }
    // Nothing compiled that the backend does not know about.
    assert_eq!(ptx.matches(".entry ").count(), names.len());
    // Every file is in the program.
    for (file, _) in kernels::SOURCES {
        assert!(kernels::program_source().contains(&format!("// ---- {file} ----")));
    }
}

#[test]
fn a_kernel_that_does_not_compile_is_an_error_with_nvrtc_log() {
    assert!(nvrtc_present(), "{HOW}");
    let broken = format!(
        "{}\nextern \"C\" __global__ void broken(float* x) {{ x[0] = undefined_name; }}\n",
        kernels::SOURCES[0].1
    );
    let err = kernels::compile_source(&broken, (9, 0)).expect_err("must not compile");
    assert!(err.to_string().contains("undefined_name"), "{err}");
}

#[test]
fn kernel_names_cover_supported_geometries() {
    assert_eq!(
        kernels::decode_kernel_name(128, 4).as_deref(),
        Some("paged_decode_hd128_g4")
    );
    // Qwen2.5-7B: 28 query heads over 4 KV heads runs in the group-8 instance.
    assert_eq!(
        kernels::decode_kernel_name(128, 7).as_deref(),
        Some("paged_decode_hd128_g8")
    );
    assert_eq!(kernels::decode_kernel_name(128, 16), None);
    assert_eq!(kernels::decode_kernel_name(256, 1), None);
    assert_eq!(
        kernels::prefill_kernel_name(16).as_deref(),
        Some("prefill_attention_hd16")
    );
}
