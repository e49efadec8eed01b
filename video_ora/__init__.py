"""video-ora: fine-tune Qwen3-VL / Qwen3.5 video LLMs to answer with the time segments worth keeping.

The console entry point `video-ora` (video_ora/cli.py) dispatches to the module verbs (prep, train.*).
"""
