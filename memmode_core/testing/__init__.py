"""Tools for testing code that runs on memmode: :class:`StrictStreams`, a strict CPU model of an
accelerator's asynchronous copies (install it with ``memmode_core.engine.streams.installed``)."""

from memmode_core.testing.strict_streams import StrictStreams, StrictStreamsError

__all__ = ["StrictStreams", "StrictStreamsError"]
