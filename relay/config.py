"""Settings, by their public name: `relay.config.load()` and `relay.config.load_pipeline()` for the
pipeline from Python (relay.core.config)."""

from relay.core.config import PipelineSettings, Settings, load, load_pipeline

__all__ = ["PipelineSettings", "Settings", "load", "load_pipeline"]
