"""LoRA adapters on a served base model (S-LoRA / Punica style): PEFT folders read and checked
against the model, a fixed number of slots the model's projections read, and each step's rows
grouped by adapter for the batched low-rank products (``docs/lora.md``)."""
