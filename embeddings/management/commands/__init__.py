"""Management commands: export, Triton, the local stack, embedding from the shell."""
