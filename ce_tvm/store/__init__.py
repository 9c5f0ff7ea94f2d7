"""A kernel's name and files, without the compiler or torch: its key
(``spec``), targets, tuning records (read side), where modules live and who
may write them (``paths``), how files enter a directory (``files``), and the
TVM runtime library (``tvmlib``). Imports ``kernels`` only for record lookup.
"""
