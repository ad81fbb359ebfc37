package dev.weir.bench.flink;

import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.ObjectWriter;
import java.util.Map;
import java.util.concurrent.atomic.AtomicReference;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.serialization.ByteArraySerializer;

/**
 * Fills a topic with the input of weir-bench's Kafka → Kafka row
 * (bench/src/kafka.rs, produce_events): message seq = 0..events-1 is
 * {"seq":seq,"key":seq % keys,"value":seq}, without a Kafka key, in
 * partition key % partitions, all acknowledged before it exits.
 */
public class Fill {
    public static void main(String[] args) throws Exception {
        if (args.length != 4) {
            System.err.println("usage: Fill BOOTSTRAP TOPIC EVENTS KEYS");
            System.exit(2);
        }
        String topic = args[1];
        long events = Long.parseLong(args[2]), keys = Math.max(1, Long.parseLong(args[3]));
        ObjectWriter json = new ObjectMapper().writerFor(Event.class);
        Map<String, Object> config = Map.of(
                ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, args[0],
                ProducerConfig.LINGER_MS_CONFIG, 20,
                ProducerConfig.BATCH_SIZE_CONFIG, 256 * 1024);
        AtomicReference<Exception> failed = new AtomicReference<>();
        try (KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(config, new ByteArraySerializer(), new ByteArraySerializer())) {
            int partitions = producer.partitionsFor(topic).size();
            Event e = new Event();
            for (long seq = 0; seq < events && failed.get() == null; seq++) {
                e.seq = seq;
                e.key = seq % keys;
                e.value = seq;
                producer.send(new ProducerRecord<>(topic, (int) (e.key % partitions), null, json.writeValueAsBytes(e)),
                        (metadata, error) -> { if (error != null) failed.compareAndSet(null, error); });
            }
            producer.flush();
        }
        if (failed.get() != null) {
            throw failed.get();
        }
        System.err.println("produced " + events + " messages over " + keys + " keys to " + topic);
    }
}
