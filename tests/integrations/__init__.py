"""A package only so that pytest never puts ``tests/integrations`` on sys.path.

pytest's default import mode ("prepend") inserts into sys.path the first folder above a
test module that has no ``__init__.py``. Were that ever this folder (a test module or a
conftest.py placed directly in it), its subfolder ``vllm`` would become the top-level
``vllm`` and hide the real package (or, without vLLM, pose as it). With this file, a
module here is ``integrations.<name>`` under ``tests/`` and ``tests/integrations/vllm`` is
only ever a folder of test modules.
"""
