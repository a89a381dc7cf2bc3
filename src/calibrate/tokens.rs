//! The token-frequency exponent of a measured token stream: Zipf's
//! `P(rank r) ~ r^-s` fitted to `profile tokens`' distinct ids per batch, so
//! a user sees how far their data is from the `token_zipf_exponent` prior.

use crate::cost::sparse::zipf_distinct;
use crate::profile::TokenPoint;
use argmin::core::{CostFunction, Error, Executor, State};
use argmin::solver::goldensectionsearch::GoldenSectionSearch;

/// The exponent's search range: `token_zipf_exponent`'s.
const EXPONENT_RANGE: (f64, f64) = (0.3, 2.5);

struct LogError<'a> {
    points: &'a [TokenPoint],
}

impl CostFunction for LogError<'_> {
    type Param = f64;
    type Output = f64;

    /// Squared error of log distinct ids: batches of every size weigh alike.
    fn cost(&self, s: &f64) -> Result<f64, Error> {
        Ok(self
            .points
            .iter()
            .map(|p| {
                let model = zipf_distinct(p.vocab as f64, p.tokens as f64, *s).max(1e-9);
                (model.ln() - p.distinct.ln()).powi(2)
            })
            .sum())
    }
}

/// The Zipf exponent that best reproduces `points` (golden-section search
/// on the log error), with the fit's root-mean-square relative error; none
/// without points. Batches of one token say nothing and are left out.
pub fn fit_zipf_exponent(points: &[TokenPoint]) -> Option<(f64, f64)> {
    let informative: Vec<TokenPoint> = points.iter().filter(|p| p.tokens > 1).cloned().collect();
    if informative.is_empty() {
        return None;
    }
    let problem = LogError {
        points: &informative,
    };
    let solver = GoldenSectionSearch::new(EXPONENT_RANGE.0, EXPONENT_RANGE.1)
        .ok()?
        .with_tolerance(1e-4)
        .ok()?;
    let result = Executor::new(problem, solver)
        .configure(|state| state.param(1.0).max_iters(200))
        .run()
        .ok()?;
    let s = *result.state().get_best_param()?;
    let cost = LogError {
        points: &informative,
    }
    .cost(&s)
    .ok()?;
    Some((s, (cost / informative.len() as f64).sqrt()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exponent_of_a_zipf_stream_comes_back() {
        let points: Vec<TokenPoint> = [16u64, 256, 4096, 65536]
            .iter()
            .map(|&n| TokenPoint {
                vocab: 50_000,
                tokens: n,
                distinct: zipf_distinct(50_000.0, n as f64, 1.2),
                batches: 1,
            })
            .collect();
        let (s, error) = fit_zipf_exponent(&points).unwrap();
        assert!((s - 1.2).abs() < 0.01, "{s}");
        assert!(error < 1e-3);
        assert!(fit_zipf_exponent(&[]).is_none());
    }
}
