"""Engine dumps: files another engine wrote (SGLang, Megatron-LM, per-pass), read and mapped onto HF names."""
