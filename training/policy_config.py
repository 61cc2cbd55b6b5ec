"""The policy's shape (the `policy` settings section), apart from torch and transformers: loading settings
must not import the model code."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PolicyConfig(BaseModel):
    """Shape of a freshly built policy. The defaults give a ~1M-parameter model."""

    model_config = ConfigDict(extra="forbid")  # a typo in a setting must not pass silently

    hidden_size: int = Field(128, description="Width of the residual stream (d_model).")
    num_layers: int = Field(4, description="Number of transformer decoder blocks.")
    num_heads: int = Field(4, description="Query heads per attention layer; must divide hidden_size.")
    num_kv_heads: int = Field(2, description="Key/value heads (grouped-query attention); must divide num_heads.")
    intermediate_size: int = Field(384, description="Hidden width of the SwiGLU MLP in each block.")
    max_position_embeddings: int = Field(1024, description="Longest sequence (prompt + completion) the model is configured for.")
    rope_theta: float = Field(10000.0, description="Base period of the rotary position embedding.")
    tie_word_embeddings: bool = Field(
        True, description="Share the input embedding matrix with the output head (saves vocab x hidden)."
    )
