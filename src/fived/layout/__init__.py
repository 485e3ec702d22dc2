"""The layout core: what a layout is and how it places a model on the ranks, in plain Python (no
torch), so the planner, the pages and the runtime read one description.

  layout.py        `Layout` (every degree of freedom of a run's layout), the names of schedules,
                   checkpointing modes and precisions (with their byte sizes), the mesh order
  spec.py          the sharding spec: how each mesh dimension cuts every tensor of a model
  stages.py        the pipeline stage split and which stages (chunks) each pipeline rank holds
  schedule_sim.py  every pipeline schedule's action lists without running: bubble, in-flight micro-batches
  rules.py         the rules a layout must meet before launch, each broken one as one line
  bounds.py        the ranges a config's numbers must lie in (lr, betas, sizes), checked with the rules
"""
