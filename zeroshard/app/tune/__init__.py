"""`zeroshard tune`: the fastest configuration that fits, by estimate and by measurement."""
