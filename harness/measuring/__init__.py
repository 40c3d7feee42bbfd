"""The measuring loop of a run: the run folder and its manifest (`run`), the ablation matrix
(`ablation`), warm-up and interleaved trials (`measure`), and the side-by-side engine benchmark
(`bench_engine`)."""
