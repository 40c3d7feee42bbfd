"""The expert store: which experts sit in fast memory (`expert_store`, `resident`, `native`), the
tiers that hold the rest (`tiers`), the prefetcher (`prefetch`), and the factory that wires them for a
session (`factory`)."""
