"""What an evaluation tells about the model, and what the run does with it.

    metrics    the eval loss, perplexity and greedy accuracy over the whole eval split (every rank its share)
    best       which evaluation was the best so far, and whether the run should stop early
    samples    greedy completions of trainer.eval_prompts at every evaluation (no collective while generating)
    save_check which proof each save gets (trainer.save_check), and best/ as a verified copy
    readback   every save's files read back bit for bit against the live trainable tensors
    peft_check an adapter's round trip through plain peft: its logits, the merged model's weights (a rounding bound)
    full_check a full fine-tune's round trip through plain transformers, bit for bit, tied head included
    host       the check's host: all its cores, room to keep a GPU run's base (Liger's classes: ddptrain.model.liger)

The trainer calls them; each takes the values it needs as arguments (no config group is read here).
"""
