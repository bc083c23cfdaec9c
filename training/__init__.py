"""How the shipped model was made: data and tokenizer, training, MTP distillation, export to an HF
checkpoint (`python -m training.<name>`)."""
