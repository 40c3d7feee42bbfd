"""Checkpoints moebench makes: the bundled model (`bundled`, `train`, `train_model`), random models
(`random`, `synth`) and GGUF export for llama.cpp (`export_gguf`)."""
