//! Helpers shared by the engine's integration tests.

/// Cosine similarity of two logit vectors, summed in f64.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum();
    let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum();
    dot / (na.sqrt() * nb.sqrt())
}
