"""cyllm._ext: the compiled CPU kernels (this folder is installed as the package cyllm._ext).

kernels.pyx is built by setup.py into cyllm._ext.kernels; cyllm.backends.cpu wraps it.
"""
