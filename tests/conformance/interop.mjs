// The official TypeScript client (@durable-streams/client) against a subengine gateway,
// driven by tests/acceptance/test_durable_streams_clients.py. One command per run:
//
//   node interop.mjs produce URL FIRST COUNT [close]
//       create the JSON stream if needed, append messages {"n": FIRST..FIRST+COUNT-1}
//       through an idempotent producer (epoch FIRST, so each run is a new epoch), and
//       close the stream after them with `close`; prints {"offset": ...}
//   node interop.mjs follow URL OFFSET COUNT MODE
//       read from OFFSET live (MODE: sse or long-poll) until COUNT messages came;
//       prints {"messages": [...], "offset": ..., "closed": ...}
//   node interop.mjs fork URL SOURCE [OFFSET]
//       create the stream at URL as a fork of the stream at path SOURCE (at OFFSET, or
//       at its tail), by the client's own create() with the fork headers; append
//       {"n": "fork"} through an idempotent producer and read the fork from the
//       beginning, catch-up only; prints {"contentType": ..., "messages": [...],
//       "offset": ...}
//
// Each printed line is JSON, so the test reads what the client saw.
import { DurableStream, IdempotentProducer } from "@durable-streams/client"

const [command, url, ...rest] = process.argv.slice(2)

async function produce(first, count, close) {
  const stream = await DurableStream.create({ url, contentType: "application/json" })
  const producer = new IdempotentProducer(stream, "interop-producer", { epoch: first, lingerMs: 5 })
  for (let n = first; n < first + count; n++) {
    producer.append(JSON.stringify({ n }))
  }
  await producer.flush()
  if (close) {
    await producer.close()
  }
  const head = await stream.head()
  console.log(JSON.stringify({ offset: head.offset, closed: head.streamClosed ?? false }))
}

async function follow(offset, count, live) {
  const stream = new DurableStream({ url })
  const controller = new AbortController()
  const response = await stream.stream({ offset, live, signal: controller.signal })
  const messages = []
  for await (const message of response.jsonStream()) {
    messages.push(message)
    console.log(JSON.stringify({ seen: message }))
    if (messages.length >= count) {
      break
    }
  }
  controller.abort()
  console.log(
    JSON.stringify({ messages, offset: response.offset, closed: response.streamClosed })
  )
}

async function fork(source, offset) {
  // the client has no fork call: the headers of its handle go with its create()
  const headers = { "Stream-Forked-From": source }
  if (offset) {
    headers["Stream-Fork-Offset"] = offset
  }
  const created = await DurableStream.create({ url, headers })
  const stream = new DurableStream({ url, contentType: created.contentType })
  const failures = []
  const producer = new IdempotentProducer(stream, "fork-producer", {
    epoch: 0,
    lingerMs: 5,
    onError: (error) => failures.push(error),
  })
  producer.append(JSON.stringify({ n: "fork" }))
  await producer.flush()
  if (failures.length) {
    throw failures[0]
  }
  const response = await stream.stream({ offset: "-1", live: false })
  const messages = await response.json()
  console.log(
    JSON.stringify({ contentType: created.contentType, messages, offset: response.offset })
  )
}

if (command === "produce") {
  await produce(Number(rest[0]), Number(rest[1]), rest[2] === "close")
} else if (command === "follow") {
  await follow(rest[0], Number(rest[1]), rest[2])
} else if (command === "fork") {
  await fork(rest[0], rest[1])
} else {
  throw new Error(`unknown command ${command}`)
}
