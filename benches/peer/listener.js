// The peer relay of benches/peer.rs: pg-transactional-outbox's logical-replication listener
// whose handler publishes each outbox message to RabbitMQ on an amqplib confirm channel
// (persistent, mandatory) and returns only when the broker confirmed it; the package marks the
// message processed and acknowledges its WAL position after that.
//
//   node listener.js setup    creates the package's outbox table, its publication and its
//                             replication slot (the package's own DatabaseSetup SQL)
//   node listener.js listen   runs the listener until SIGTERM
//
// Configuration from the environment (set by benches/peer.rs):
//   PEER_DB          database name (host 127.0.0.1:5432, user postgres)
//   PEER_SLOT        replication slot name, PEER_PUBLICATION publication name
//   PEER_MODE        `default` (no concurrency strategy given: the package's default, a mutex
//                    across all messages) or `segment`
//                    (createReplicationSegmentMutexConcurrencyController: one mutex per
//                    message segment)
//   PEER_AMQP        AMQP URL, PEER_EXCHANGE the exchange to publish to (routing key = the
//                    message type)
'use strict';

const { Client } = require('pg');
const amqp = require('amqplib');
const {
  DatabaseSetup,
  createReplicationSegmentMutexConcurrencyController,
  getDefaultLogger,
  initializeReplicationMessageListener,
} = require('pg-transactional-outbox');

const env = (name) => {
  const v = process.env[name];
  if (!v) {
    console.error(`listener.js: ${name} is not set`);
    process.exit(2);
  }
  return v;
};

const dbConfig = () => ({
  host: '127.0.0.1',
  port: 5432,
  user: 'postgres',
  database: env('PEER_DB'),
});

const setupConfig = () => ({
  outboxOrInbox: 'outbox',
  database: env('PEER_DB'),
  schema: 'public',
  table: 'outbox',
  listenerRole: 'postgres',
  handlerRole: 'postgres',
  publication: env('PEER_PUBLICATION'),
  replicationSlot: env('PEER_SLOT'),
});

async function setup() {
  const config = setupConfig();
  const client = new Client(dbConfig());
  await client.connect();
  await client.query(DatabaseSetup.dropAndCreateTable(config));
  await client.query(DatabaseSetup.setupReplicationCore(config));
  // The package's note: the slot must be created in a transaction of its own.
  await client.query(DatabaseSetup.setupReplicationSlot(config));
  await client.end();
}

async function listen() {
  const logger = getDefaultLogger('peer');
  logger.level = 'warn';
  const conn = await amqp.connect(env('PEER_AMQP'));
  const channel = await conn.createConfirmChannel();
  const exchange = env('PEER_EXCHANGE');
  const publisher = {
    handle: (message) =>
      new Promise((resolve, reject) => {
        const body = Buffer.from(JSON.stringify(message.payload));
        channel.publish(
          exchange,
          message.messageType,
          body,
          {
            persistent: true,
            mandatory: true,
            messageId: message.id,
            contentType: 'application/json',
            type: message.messageType,
            headers: { 'x-aggregate-id': message.aggregateId },
          },
          (err) => (err ? reject(err) : resolve()),
        );
      }),
  };
  const mode = env('PEER_MODE');
  const strategies = {};
  if (mode === 'segment') {
    strategies.concurrencyStrategy =
      createReplicationSegmentMutexConcurrencyController();
  } else if (mode !== 'default') {
    console.error(`listener.js: PEER_MODE ${mode}: default or segment`);
    process.exit(2);
  }
  const [shutdown] = initializeReplicationMessageListener(
    {
      outboxOrInbox: 'outbox',
      dbListenerConfig: dbConfig(),
      settings: {
        dbSchema: 'public',
        dbTable: 'outbox',
        dbPublication: env('PEER_PUBLICATION'),
        dbReplicationSlot: env('PEER_SLOT'),
      },
    },
    publisher,
    logger,
    strategies,
  );
  const stop = async () => {
    await shutdown();
    await channel.close().catch(() => {});
    await conn.close().catch(() => {});
    process.exit(0);
  };
  process.once('SIGTERM', stop);
  process.once('SIGINT', stop);
}

const command = process.argv[2];
const run = command === 'setup' ? setup : command === 'listen' ? listen : null;
if (!run) {
  console.error('usage: node listener.js setup|listen');
  process.exit(2);
}
run().catch((e) => {
  console.error(`listener.js ${command}: ${e.stack || e}`);
  process.exit(1);
});
