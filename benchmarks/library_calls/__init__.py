"""Direct calls of the libraries behind plugserve backends, one module per backend name: the shootout
times them beside the backends to measure what the wrappers cost."""
