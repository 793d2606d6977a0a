"""omni speech stage family: models that speak, as stages.

Qwen2.5-Omni split where its own ``generate`` splits it: ``speech.thinker`` (text, image
and audio in; text tokens out, each with the thinker's embedding and last hidden state),
``speech.talker`` (those rows -> codec tokens), ``speech.token2wav`` (codes -> mel by
flow matching -> waveform by BigVGAN, in windows; or its halves in two processes,
``speech.code2mel`` and ``speech.mel2wav``) and ``speech.audio_encode`` (WAV, FLAC, MP3,
Opus, AAC or raw PCM, streamed).
"""

__version__ = "0.1.0"
