"""Layer 1, quantization mechanics: packed layers and their dequantizing forward (``layers``), and the
``Quantizer`` base class (``quantizer``) whose default ``check`` and ``quantize`` are those mechanics.

Beside the engine, above the contracts; neither imports the other.
"""
