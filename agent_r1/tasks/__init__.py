"""The built-in tasks, each one plugin module (agent_r1/task.py says what a task provides):

* `calculator`: synthetic arithmetic word problems, a calculator tool, exact numeric reward;
* `gsm8k`: GSM8K with the calculator, cold-start demonstrations from its `<<expr=result>>` annotations;
* `hotpotqa`: multi-hop QA with a search tool over Wikipedia paragraphs, EM / F1 rewards.
* `gateway`: an agent program written against the OpenAI API, run unchanged (agent_r1/gateway).

Nothing here is imported by the library: `task=NAME` resolves a module at run time.
"""
