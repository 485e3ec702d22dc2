"""Hugging Face models in and out of fived, converted at the boundary (torchtitan's state-dict
adapter idea): the trainer and the model only ever see fived's canonical names and shapes.

  config_map   config.json <-> ModelConfig; what fived cannot express exactly is refused in one line
  names        fived canonical names <-> Hugging Face tensor names (experts stacked / unstacked)
  reader       a model directory's safetensors, read one box at a time (safe_open + get_slice)
  init         `--init-from`: each rank fills only the pieces its placements describe
  export       `fived export`: a checkpoint streamed to a Hugging Face directory, one tensor at a time
  safetensors_out  the streaming safetensors writer export uses

Nothing here imports transformers: it reads and writes files only.
"""
