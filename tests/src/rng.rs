//! xorshift64*: a small deterministic generator for random test cases and
//! benchmark loads; a failure reproduces from its seed.

/// The generator's state (any nonzero seed).
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// Seeded from `$var` when it is set, else from the clock; the seed is
    /// printed (`VAR=seed`) so that a failure can be replayed.
    pub fn from_env(var: &str) -> Self {
        let seed = std::env::var(var)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .expect("a clock after 1970")
                    .as_nanos() as u64
                    | 1
            });
        eprintln!("{var}={seed}");
        Self(seed)
    }

    #[allow(clippy::should_implement_trait, reason = "not an iterator")]
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// One of `xs` (not empty).
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len() as u64) as usize]
    }
}
