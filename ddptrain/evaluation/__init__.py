"""What an evaluation tells about the model, and what the run does with it.

    metrics    the eval loss, perplexity and greedy accuracy over the whole eval split (every rank its share)
    best       which evaluation was the best so far, and whether the run should stop early
    samples    greedy completions of trainer.eval_prompts at every evaluation (no collective while generating)
    save_check proof that a saved adapter loads in plain peft and computes what the training model computes
    full_check proof that a full fine-tune's saved model loads in plain transformers bit for bit, tied head included

The trainer calls them; each takes the values it needs as arguments (no config group is read here).
"""
