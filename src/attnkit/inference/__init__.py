"""Using a trained model: ``translate`` (texts to n-best translations by greedy or beam search),
``classify`` (labels and probabilities), ``scores`` (sacreBLEU, chrF, accuracy, macro-F1),
``attention_maps`` (every attention weight of one text, per kind, layer and head), ``language_model`` (scoring and
continuing text) and ``chat`` (a conversation through the run's chat template)."""
