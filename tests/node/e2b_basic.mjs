// E2B's npm SDK (@e2b/code-interpreter, pinned in scripts/test) against forkbox serve:
// E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY point it at the server. Prints one JSON
// line of what came back; tests/python/test_e2b_frameworks.py checks it.
import { Sandbox } from '@e2b/code-interpreter'

const sbx = await Sandbox.create()
const out = { sandboxId: sbx.sandboxId }
try {
  await sbx.runCode('x = 41')
  const ex = await sbx.runCode("print('hello'); x + 1")
  out.text = ex.text
  out.stdout = ex.logs.stdout
  out.error = ex.error ? ex.error.name : null
  const err = await sbx.runCode("raise KeyError('k')")
  out.raised = err.error ? [err.error.name, err.error.value] : null

  const cmd = await sbx.commands.run('echo out; echo err >&2; [[ -n $BASH_VERSION ]] && pwd')
  out.command = [cmd.stdout, cmd.stderr, cmd.exitCode]
  try {
    await sbx.commands.run('exit 3')
    out.exitError = null
  } catch (e) {
    out.exitError = [e.constructor.name, e.exitCode]
  }

  await sbx.files.write('/home/user/node.txt', 'from node')
  out.read = await sbx.files.read('/home/user/node.txt')
  out.listed = (await sbx.files.list('/home/user')).map((e) => e.name).includes('node.txt')
  out.python = (await sbx.runCode("open('/home/user/node.txt').read()")).text
} finally {
  out.killed = await sbx.kill()
}
out.afterKill = await Sandbox.kill(out.sandboxId)
console.log(JSON.stringify(out))
