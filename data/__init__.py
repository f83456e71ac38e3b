"""The frozen target, conversations → tokens with assistant loss masks, target features."""
