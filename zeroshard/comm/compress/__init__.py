"""Compression on the wire: block codecs, quantized messages, qwZ, qgZ, PowerSGD and compressed reductions."""
