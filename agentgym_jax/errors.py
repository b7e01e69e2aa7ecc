"""User-facing exception classes of agentgym_jax.

Every error a user can trigger with bad input (a wrong path, a broken checkpoint, an unsupported
config, a tokenizer that cannot render chats) is raised as one of these, with a message that names
the problem and how to fix it.
"""


class AgentGymError(Exception):
    """Base class of all user-facing agentgym_jax errors."""


class CheckpointError(AgentGymError):
    """A checkpoint (Hugging Face directory, safetensors or GGUF file) is missing, broken or unsupported."""


class ConfigError(AgentGymError):
    """A model or run configuration is invalid or names an unsupported feature."""


class TokenizerError(AgentGymError):
    """A tokenizer or chat template cannot be loaded or cannot render a conversation as required."""
