"""`zeroshard estimate`: memory, communication and the peak of a step, counted on the model without a GPU."""
