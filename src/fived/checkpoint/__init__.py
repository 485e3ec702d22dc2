"""Checkpoints: the checkpointer (atomic steps, keep/prune, resume), DCP reads and writes by placement, and the integrity manifest (`verify`)."""
