package dev.weir.bench.flink;

import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.ObjectReader;
import com.fasterxml.jackson.databind.ObjectWriter;
import java.io.IOException;
import java.lang.management.ManagementFactory;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.Comparator;
import java.util.HashMap;
import java.util.Map;
import java.util.stream.Stream;
import org.apache.flink.api.common.JobExecutionResult;
import org.apache.flink.api.common.accumulators.LongCounter;
import org.apache.flink.api.common.eventtime.WatermarkStrategy;
import org.apache.flink.api.common.functions.OpenContext;
import org.apache.flink.api.common.serialization.AbstractDeserializationSchema;
import org.apache.flink.api.common.state.ValueState;
import org.apache.flink.api.common.state.ValueStateDescriptor;
import org.apache.flink.configuration.CheckpointingOptions;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.configuration.CoreOptions;
import org.apache.flink.configuration.StateBackendOptions;
import org.apache.flink.configuration.WebOptions;
import org.apache.flink.connector.base.DeliveryGuarantee;
import org.apache.flink.connector.kafka.sink.KafkaRecordSerializationSchema;
import org.apache.flink.connector.kafka.sink.KafkaSink;
import org.apache.flink.connector.kafka.source.KafkaSource;
import org.apache.flink.connector.kafka.source.enumerator.initializer.OffsetsInitializer;
import org.apache.flink.core.execution.CheckpointingMode;
import org.apache.flink.runtime.util.EnvironmentInformation;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.streaming.api.functions.KeyedProcessFunction;
import org.apache.flink.util.Collector;
import org.apache.kafka.clients.producer.ProducerRecord;

/**
 * The Flink twin of weir's Kafka → Kafka benchmark job:
 *
 * <pre>
 * source: kafka (read_committed, earliest → the end offsets at start)
 * steps:  key_by: key, running_count: count
 * sink:   kafka exactly-once, message key = key
 * checkpoint: every 1 s, exactly-once, hashmap state, local directory
 * </pre>
 *
 * Runs in a local MiniCluster and prints one JSON line on stdout when the
 * bounded job has finished.
 */
public class KafkaCount {
    // Jackson's readers and writers are thread-safe: one per JVM serves every subtask.
    private static final ObjectMapper JSON = new ObjectMapper();
    private static final ObjectReader READ_EVENT = JSON.readerFor(Event.class);
    private static final ObjectWriter WRITE_EVENT = JSON.writerFor(Event.class);

    public static void main(String[] args) throws Exception {
        Map<String, String> a = parse(args);
        String bootstrap = a.get("bootstrap"), input = a.get("input"), output = a.get("output"), runId = a.get("run-id");
        int parallelism = Integer.parseInt(a.get("parallelism"));

        // Everything the MiniCluster writes (checkpoints, spill and upload
        // directories) goes to one directory per run, removed at the end.
        Path tmp = Files.createTempDirectory("weir-flink-");
        Configuration conf = new Configuration();
        conf.set(CoreOptions.TMP_DIRS, tmp.toString());
        conf.set(WebOptions.TMP_DIR, tmp.toString());
        conf.set(CheckpointingOptions.CHECKPOINTING_INTERVAL, Duration.ofSeconds(1));
        conf.set(CheckpointingOptions.CHECKPOINTING_CONSISTENCY_MODE, CheckpointingMode.EXACTLY_ONCE);
        conf.set(StateBackendOptions.STATE_BACKEND, "hashmap");
        conf.set(CheckpointingOptions.CHECKPOINT_STORAGE, "filesystem");
        conf.set(CheckpointingOptions.CHECKPOINTS_DIRECTORY, tmp.resolve("checkpoints").toUri().toString());
        // Already Flink 2's default; named because the last transaction is
        // committed by the checkpoint taken after the bounded source ends.
        conf.set(CheckpointingOptions.ENABLE_CHECKPOINTS_AFTER_TASKS_FINISH, true);

        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(conf);
        env.setParallelism(parallelism);

        KafkaSource<Event> source = KafkaSource.<Event>builder()
                .setBootstrapServers(bootstrap)
                .setTopics(input)
                .setGroupId("weir-flink-" + runId)
                .setStartingOffsets(OffsetsInitializer.earliest())
                .setBounded(OffsetsInitializer.latest())
                .setProperty("isolation.level", "read_committed")
                // Like weir's source: positions live in checkpoints only.
                .setProperty("commit.offsets.on.checkpoint", "false")
                .setValueOnlyDeserializer(new EventDeserializer())
                .build();

        KafkaSink<Event> sink = KafkaSink.<Event>builder()
                .setBootstrapServers(bootstrap)
                .setDeliveryGuarantee(DeliveryGuarantee.EXACTLY_ONCE)
                // Unique per run: a run must not fence or abort another's transactions.
                .setTransactionalIdPrefix("weir-flink-" + runId)
                // Flink's default (1 h) exceeds the broker's 15 min cap; 10 min is weir's default.
                .setProperty("transaction.timeout.ms", String.valueOf(Duration.ofMinutes(10).toMillis()))
                .setRecordSerializer(new EventSerializer(output))
                .build();

        env.fromSource(source, WatermarkStrategy.noWatermarks(), "kafka " + input)
                .keyBy(e -> e.key)
                .process(new RunningCount())
                .name("running_count")
                .sinkTo(sink)
                .name("kafka " + output);

        long submit = System.nanoTime();
        JobExecutionResult result;
        try {
            result = env.execute("weir-bench kafka-count " + runId);
        } finally {
            deleteTree(tmp);
        }
        long end = System.nanoTime();
        double wall = (System.currentTimeMillis() - ManagementFactory.getRuntimeMXBean().getStartTime()) / 1000.0;
        Long records = result.getAccumulatorResult(RunningCount.RECORDS);
        System.out.printf("{\"engine\":\"flink\",\"flink\":\"%s\",\"parallelism\":%d,\"records\":%d,\"wall_s\":%.3f,\"submit_to_end_s\":%.3f,\"job_runtime_s\":%.3f}%n",
                EnvironmentInformation.getVersion(), parallelism, records == null ? 0 : records,
                wall, (end - submit) / 1e9, result.getNetRuntime() / 1000.0);
    }

    /** weir's running_count: each record leaves with its key's count so far, 1 for the first. */
    static class RunningCount extends KeyedProcessFunction<Long, Event, Event> {
        static final String RECORDS = "records";
        private transient ValueState<Long> count;
        private transient LongCounter records;

        @Override
        public void open(OpenContext context) {
            count = getRuntimeContext().getState(new ValueStateDescriptor<>("count", Long.class));
            records = new LongCounter();
            getRuntimeContext().addAccumulator(RECORDS, records);
        }

        @Override
        public void processElement(Event e, Context ctx, Collector<Event> out) throws IOException {
            Long c = count.value();
            e.count = c == null ? 1 : c + 1;
            count.update(e.count);
            records.add(1);
            out.collect(e);
        }
    }

    static class EventDeserializer extends AbstractDeserializationSchema<Event> {
        @Override
        public Event deserialize(byte[] message) throws IOException {
            return READ_EVENT.readValue(message);
        }
    }

    /** Value: the record as JSON; key: the key's decimal text, as weir's sink writes them. */
    static class EventSerializer implements KafkaRecordSerializationSchema<Event> {
        private final String topic;

        EventSerializer(String topic) {
            this.topic = topic;
        }

        @Override
        public ProducerRecord<byte[], byte[]> serialize(Event e, KafkaSinkContext context, Long timestamp) {
            try {
                return new ProducerRecord<>(topic, Long.toString(e.key).getBytes(StandardCharsets.UTF_8), WRITE_EVENT.writeValueAsBytes(e));
            } catch (IOException x) {
                throw new IllegalStateException("encoding " + e.seq, x);
            }
        }
    }

    static Map<String, String> parse(String[] args) {
        Map<String, String> a = new HashMap<>();
        for (int i = 0; i + 1 < args.length; i += 2) {
            if (!args[i].startsWith("--")) {
                usage("unexpected argument " + args[i]);
            }
            a.put(args[i].substring(2), args[i + 1]);
        }
        if (args.length % 2 != 0) {
            usage("option " + args[args.length - 1] + " has no value");
        }
        for (String required : new String[] {"bootstrap", "input", "output", "parallelism", "run-id"}) {
            if (!a.containsKey(required)) {
                usage("--" + required + " is required");
            }
        }
        return a;
    }

    static void usage(String problem) {
        System.err.println("KafkaCount: " + problem + "\nusage: KafkaCount --bootstrap HOST:PORT --input TOPIC --output TOPIC --parallelism P --run-id ID");
        System.exit(2);
    }

    static void deleteTree(Path dir) throws IOException {
        try (Stream<Path> paths = Files.walk(dir)) {
            for (Path p : (Iterable<Path>) paths.sorted(Comparator.reverseOrder())::iterator) {
                Files.deleteIfExists(p);
            }
        }
    }
}
