"""trainmon: an event-sourced metrics pipeline for LLM training runs.

Training side: ``trainmon.producer`` (pydantic + kafka-python only).
Everything else (consumers, broker launcher, CLI) is imported on demand.
"""

__version__ = "0.1.0"
