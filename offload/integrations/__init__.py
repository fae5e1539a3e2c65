"""Where users already are: DeepSpeed JSON configs read into our Config (deepspeed.py). Never imported by
the core at import time; a module here that needs an optional package imports it itself."""
