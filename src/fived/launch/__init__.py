"""Launching a run: checks before any rank starts (`run_setup`, `memory_fit`), the run directory's lock and summary, forked or torchrun ranks (`ranks`) and the fault-tolerant supervisor."""
