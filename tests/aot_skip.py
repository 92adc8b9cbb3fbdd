"""Why the ahead-of-time TPU compile tests skip where libtpu is missing."""

REASON = (
  "libtpu is not installed: the ahead-of-time compiles for real TPU generations need the "
  "tpu extra (pip install -e '.[tpu]', as make test does)"
)
