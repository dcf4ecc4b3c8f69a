"""A served-step trace read back (`reader`: every rank's rotated files, the headers checked, torn
last lines reported) and what one line says (`steps`: the step model, its composition and
kind). Plain data: nothing here imports vLLM."""
