//! The model's weights on the device: matrices and the embedding in bf16, norms and
//! biases in f32 (they are small and used by f32 kernels).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use crate::error::Result;
use crate::model::weights::{Linear, Weights};

/// Host f32 to bf16 bits (round to nearest even).
pub(crate) fn to_bf16_bits(v: &[f32]) -> Vec<u16> {
    v.iter()
        .map(|&x| half::bf16::from_f32(x).to_bits())
        .collect()
}

/// One projection on the device.
pub(crate) struct DeviceLinear {
    /// `[out, in]` bf16.
    pub(crate) w: CudaSlice<u16>,
    pub(crate) bias: Option<CudaSlice<f32>>,
}

impl DeviceLinear {
    fn upload(lin: &Linear, stream: &Arc<CudaStream>) -> Result<Self> {
        let w = stream
            .clone_htod(&to_bf16_bits(&lin.weight_data()?))
            .map_err(super::device_err("uploading weights"))?;
        let bias = match lin.bias() {
            Some(b) => Some(
                stream
                    .clone_htod(b)
                    .map_err(super::device_err("uploading a bias"))?,
            ),
            None => None,
        };
        Ok(Self { w, bias })
    }
}

/// One decoder layer on the device.
pub(crate) struct DeviceLayer {
    pub(crate) input_norm: CudaSlice<f32>,
    pub(crate) post_norm: CudaSlice<f32>,
    pub(crate) qkv: DeviceLinear,
    pub(crate) o: DeviceLinear,
    pub(crate) qk_norm: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    pub(crate) gate_up: DeviceLinear,
    pub(crate) down: DeviceLinear,
}

/// All weights on the device.
pub(crate) struct DeviceWeights {
    /// `[vocab, hidden]` bf16.
    pub(crate) embed: CudaSlice<u16>,
    pub(crate) layers: Vec<DeviceLayer>,
    pub(crate) norm: CudaSlice<f32>,
    /// `None` when tied to `embed`.
    pub(crate) lm_head: Option<DeviceLinear>,
}

impl DeviceWeights {
    /// Copies `w` to the device.
    pub(crate) fn upload(w: &Weights, stream: &Arc<CudaStream>) -> Result<Self> {
        let f32s = |v: &[f32]| {
            stream
                .clone_htod(v)
                .map_err(super::device_err("uploading a norm"))
        };
        let embed = stream
            .clone_htod(&to_bf16_bits(&w.embed_data()?))
            .map_err(super::device_err("uploading the embedding"))?;
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            let qk_norm = match &l.qk_norm {
                Some((q, k)) => Some((f32s(q)?, f32s(k)?)),
                None => None,
            };
            layers.push(DeviceLayer {
                input_norm: f32s(&l.input_norm)?,
                post_norm: f32s(&l.post_norm)?,
                qkv: DeviceLinear::upload(&l.qkv, stream)?,
                o: DeviceLinear::upload(&l.o, stream)?,
                qk_norm,
                gate_up: DeviceLinear::upload(&l.gate_up, stream)?,
                down: DeviceLinear::upload(&l.down, stream)?,
            });
        }
        let lm_head = if w.tied {
            None
        } else {
            Some(DeviceLinear::upload(&w.lm_head, stream)?)
        };
        Ok(Self {
            embed,
            layers,
            norm: f32s(&w.norm)?,
            lm_head,
        })
    }
}
