"""The group engine: layouts (what moves together), the runtime (moving it), input handling."""
