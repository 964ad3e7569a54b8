"""Encoded bytes into uint8 pixels: bad_images.py (an image that does not decode: named, stood in
for, tallied), jpeg_region.py (a JPEG crop decoded alone, at reduced scale where it allows, by the C
extension _jpeg_region.c where it is built), decode.py (encoded bytes -> uint8 tensors, whole or a
crop) and image_cache.py (decoded training images: one bounded copy for all loader workers, kept
only for splits small on disk)."""
