"""What a run writes and reads back: checkpoints, resume, Hugging Face weight files, the output.

Owns ``checkpoint-N`` folders and their manifest (:mod:`.checkpoints`), picking up a run where
it stopped (:mod:`.resume`), streaming weights between flat unit buffers and safetensors files
(:mod:`.hf`), the final output folder and its ``latest`` link (:mod:`.output`) and the lock that
keeps two runs out of one folder (:mod:`.out_lock`). It sits above the model (it names its
tensors) and below training, which calls it: what it reads and fills of training's state and
schedule it declares itself, as protocols (:mod:`.saved_state`).
"""
