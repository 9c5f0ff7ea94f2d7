"""ce_tvm inside training frameworks. Each submodule imports its framework, an
optional dependency: ``ce_tvm.integrations.transformers`` (Hugging Face),
``ce_tvm.integrations.trl`` (TRL), ``ce_tvm.integrations.torchtitan`` (torchtitan)."""
