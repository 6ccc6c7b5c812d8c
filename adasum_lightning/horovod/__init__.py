"""Everything Horovod, the only part of the package that imports it; importing this package imports neither
Horovod nor Lightning.
"""
