"""The HF reference engine: a run plan executed on the Hugging Face model in this process."""
