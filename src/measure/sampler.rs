//! When to stop repeating a measurement: once the 95% confidence interval of
//! the mean (Student t, statrs) is within a target fraction of the mean, or
//! a repetition or time cap is hit, whichever comes first. Warm-up
//! repetitions are never timed.

use serde::{Deserialize, Serialize};
use statrs::distribution::{ContinuousCDF, StudentsT};

/// How many repetitions a measurement takes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StoppingRule {
    /// Untimed repetitions first (allocator, autotuning, caches).
    pub warmup: usize,
    /// Timed repetitions at least (a t interval needs a few).
    pub min_repetitions: usize,
    /// Timed repetitions at most.
    pub max_repetitions: usize,
    /// Stop when the 95% interval's half-width is within this fraction of the mean.
    pub target_ci_rel: f64,
    /// Stop after this much timed work, seconds, even if the interval is wider.
    pub max_seconds: f64,
}

impl Default for StoppingRule {
    fn default() -> Self {
        StoppingRule {
            warmup: 3,
            min_repetitions: 5,
            max_repetitions: 100,
            target_ci_rel: 0.02,
            max_seconds: 60.0,
        }
    }
}

/// Mean and spread of the samples taken so far.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    pub n: usize,
    pub mean: f64,
    pub std_dev: f64,
    /// Half-width of the 95% confidence interval of the mean, relative to
    /// the mean (infinite below two samples).
    pub ci95_rel: f64,
}

/// Collects timed samples and applies a [`StoppingRule`].
#[derive(Debug, Clone)]
pub struct Sampler {
    rule: StoppingRule,
    samples: Vec<f64>,
}

impl Sampler {
    pub fn new(rule: StoppingRule) -> Self {
        Sampler {
            rule,
            samples: Vec::new(),
        }
    }

    pub fn push(&mut self, seconds: f64) {
        self.samples.push(seconds);
    }

    pub fn summary(&self) -> Summary {
        summarise(&self.samples)
    }

    /// Whether to stop: enough samples and a tight interval, or a cap.
    pub fn done(&self) -> bool {
        let n = self.samples.len();
        if n >= self.rule.max_repetitions {
            return true;
        }
        let timed: f64 = self.samples.iter().sum();
        if n >= 2 && timed >= self.rule.max_seconds {
            return true;
        }
        n >= self.rule.min_repetitions && self.summary().ci95_rel <= self.rule.target_ci_rel
    }
}

/// Mean, standard deviation and relative 95% interval of `samples`.
pub fn summarise(samples: &[f64]) -> Summary {
    let n = samples.len();
    let mean = samples.iter().sum::<f64>() / n.max(1) as f64;
    if n < 2 {
        return Summary {
            n,
            mean,
            std_dev: f64::NAN,
            ci95_rel: f64::INFINITY,
        };
    }
    let variance = samples.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let std_dev = variance.sqrt();
    let t = StudentsT::new(0.0, 1.0, (n - 1) as f64)
        .map(|d| d.inverse_cdf(0.975))
        .unwrap_or(f64::INFINITY);
    let half_width = t * std_dev / (n as f64).sqrt();
    Summary {
        n,
        mean,
        std_dev,
        ci95_rel: if mean > 0.0 {
            half_width / mean
        } else {
            f64::INFINITY
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule() -> StoppingRule {
        StoppingRule {
            warmup: 0,
            min_repetitions: 5,
            max_repetitions: 20,
            target_ci_rel: 0.02,
            max_seconds: 1e9,
        }
    }

    #[test]
    fn interval_matches_student_t() {
        // n = 4, mean 2, sample sd sqrt(2/3); t(0.975, 3) = 3.182446.
        let s = summarise(&[1.0, 2.0, 2.0, 3.0]);
        assert_eq!(s.n, 4);
        assert!((s.mean - 2.0).abs() < 1e-12);
        let expected = 3.182446 * (2.0f64 / 3.0).sqrt() / 2.0 / 2.0;
        assert!((s.ci95_rel - expected).abs() < 1e-5, "{}", s.ci95_rel);
    }

    #[test]
    fn steady_samples_stop_at_the_minimum() {
        let mut sampler = Sampler::new(rule());
        for _ in 0..4 {
            sampler.push(1.0);
            assert!(!sampler.done());
        }
        sampler.push(1.0);
        assert!(sampler.done());
    }

    #[test]
    fn noisy_samples_run_to_the_cap() {
        let mut sampler = Sampler::new(rule());
        let mut n = 0;
        while !sampler.done() {
            sampler.push(if n % 2 == 0 { 1.0 } else { 2.0 });
            n += 1;
        }
        assert_eq!(n, 20);
        assert!(sampler.summary().ci95_rel > 0.02);
    }

    #[test]
    fn the_time_cap_stops_slow_measurements() {
        let mut sampler = Sampler::new(StoppingRule {
            max_seconds: 3.0,
            ..rule()
        });
        sampler.push(2.0);
        assert!(!sampler.done());
        sampler.push(1.0);
        assert!(sampler.done());
    }
}
