"""The tensor side: the safetensors format, exact counting, scanning, verification."""
