"""Integrations of the checkpointer with training frameworks."""
__all__: list[str] = []
