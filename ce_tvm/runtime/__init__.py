"""Kernels in a process: the module cache (which builds on a miss), one
loaded module per spec (``registry``), torch tensors handed to kernels
(``tensors``, ``launch``), thread and scratch pools, the loss options, and
the chunked linear sweep. No autograd: the torch surface above adds it.
"""
